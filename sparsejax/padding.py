"""The padding id: the one value every id array (features, labels, active sets, table slots) uses for an empty slot.

Every kernel skips it (``kPadId`` in ``ffi/common.h`` is the same value); its
value in a padded feature slot is ``0``. Plain Python, so that data loading
can use it without importing JAX.
"""

PAD_ID = -1
