"""A run's configuration: read and validated (run_config), checked whole before it starts
(experiment), and the devices' heterogeneity it draws (heterogeneity)."""
