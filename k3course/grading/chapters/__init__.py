"""One module per chapter, ``chNN_<topic>.py``, each calling ``register(Exercise(...))`` at import."""
