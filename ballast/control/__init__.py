"""The control loop: controller actor, snapshot, recycling, watchdog actor, autoscaling adapter."""
