"""The Ray Serve application and the `pdserve` command line."""
