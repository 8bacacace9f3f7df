"""Mesh axis names, in one place (as haliax's ``ResourceAxis``)."""

DATA = "data"  # replicas: each holds a slice of the batch
MODEL = "model"  # tensor parallelism: each holds a slice of the weights
STAGE = "stage"  # pipeline parallelism: each holds some of the layers
