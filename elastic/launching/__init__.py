"""`elastic.launch` (a client of the driver) and the worker entry point it starts."""
