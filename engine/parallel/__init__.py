"""Tensor parallelism inside one engine: which slice each rank holds (`layout`), the
collectives between ranks (`group`), and the follower processes rank 0 drives (`workers`)."""
