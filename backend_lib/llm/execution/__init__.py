"""What runs on the device: checkpoint loading, the model classes, the KV pool, attention through
the kernels, the model runner and the sampler."""
