"""Fleet capacity model: roofline costs of a target forward on a device, throughput per replica and GPUs needed for
no speculation, one draft per target, and one shared sorted draft (`s2d plan`)."""
