"""The P/D router (``pdserve proxy``): its parts, lowest first, are ``engine``, ``state``
and ``metrics``; ``table`` and ``policies``; ``settings``; ``flow``; ``serving``;
``admin``; then ``app`` (the composition root) and ``cli``. A part imports only the parts below
it (tests/unit/test_dependencies.py); docs/architecture.md says what each holds. Each KV
connector's leg protocol is in ``pdserve.kv``, on the ground floor.
"""
