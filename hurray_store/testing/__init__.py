"""What a test of hurray_store, or of a tier written for it, builds on: real services
on loopback ports (``services``) and the tier contract (``contract``)."""
