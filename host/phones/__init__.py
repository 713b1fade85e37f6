"""Phones emulated on this machine: zl-phone and Kotlin phones started as processes, and their network."""
