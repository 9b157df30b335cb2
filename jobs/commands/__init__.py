"""The ``ernie5`` commands, one module per family; each handler beside its parser."""
