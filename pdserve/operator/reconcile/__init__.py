"""One reconcile pass of a PDDeployment: read, plan, write (steps), autoscale, and its record as spans."""
