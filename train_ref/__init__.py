"""The reference trainer (``python -m train_ref.train``): the training library's first user.

Its model, data, config, schedule and EMA are a demo; the library it is built on is
``supervisor.resumable``, and it imports only that package's public names (tests/test_layers.py).
"""
