"""Operating Ballast: the app builder, CLI, dashboards as code, the config reference."""
