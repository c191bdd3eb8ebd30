"""Topology preset YAML files (package data)."""
