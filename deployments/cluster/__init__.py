"""What sees every replica: the cluster KV index, Serve's request routers, the replica sets they
publish, cluster health and SLA autoscaling. Runs in the router's process, the index actor and
Serve's controller; never an engine."""
