"""The core: what every strategy stands on, knowing no strategy by name.

The training state and step, the loss and batch contracts, placement, the strategy protocol, devices, the mesh
factory, logical axes and partition rules."""
