"""Imports every op module, so that the registry is complete."""
