"""Instruments of the tests and measurements, outside the fedpart package (the product never
imports them): the fault relay (relay), the virtual load generator (virtual) and the writer of
docs/components.md (reference). Run them from the repository's root: ``python -m lab.relay``."""
