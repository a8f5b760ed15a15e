"""The run, derived once on the driver: its quantities (`quantities`) and its spec (`spec`)."""
