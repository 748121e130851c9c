"""Integrations of tierstore into training frameworks."""
