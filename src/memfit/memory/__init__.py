"""Memory: the storage tracker, fake-tensor estimation, real measurement and allocator models."""
