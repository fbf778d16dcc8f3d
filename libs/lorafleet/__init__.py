"""lorafleet: the shared library (settings, names, bus, logging) and the client.

Import roots point downward only: `lorafleet_schemas` <- `lorafleet` <- `lorafleet_services`.
"""

__version__ = "0.1.0"
