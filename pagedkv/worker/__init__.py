"""The worker side of a step: input tensors, attention groups and metadata, the model runner."""
