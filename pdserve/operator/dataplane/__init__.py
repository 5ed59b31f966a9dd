"""What a pass asks the routers and engines over HTTP (drains, load), remembered per PDDeployment."""
