"""The seams with upstream code, in one place: what the installed Megatron-Bridge / Megatron-Core /
Transformer Engine offer and how we reach them.

* :mod:`.loading`: Megatron-Bridge's pure-torch helper modules, loaded with or without Transformer Engine;
* :mod:`.line`: which Megatron-Bridge line is installed, decided once from what it offers (signatures, attributes);
* :mod:`.te_compat`: Transformer Engine's THD attention entry points, chosen at run time;
* :mod:`.patches`: the registry of every change we make to an upstream object (docs/patches.md);
* :mod:`.pinning`: the ``pin_memory`` Megatron-Bridge's visual inputs lack (a registered patch).
"""
