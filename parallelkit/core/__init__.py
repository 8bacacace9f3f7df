"""The core: what every strategy stands on and knows nothing of strategies' names.

The training state and the single-device step, the contracts of the loss and the batch,
where leaves live, the protocol every strategy keeps, devices, the mesh factory, logical
axes and partition rules.
"""
