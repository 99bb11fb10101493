"""CLI subcommands; each module registers its parser in `s2d_ray.cli`."""
