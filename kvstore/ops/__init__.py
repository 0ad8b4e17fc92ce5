"""Running a node as a service: systemd notifications, metrics, health, structured logs."""
