"""Schemas: encoding a schema's modules once (``encoder``), the registry of encoded schemas and
their keys (``registry``), compiled schema artifacts on disk (``compiled``), and laying a PML
prompt over a registered schema into a ``PrefillPlan`` (``assemble``).
"""
