"""Helpers every stage uses, below all of them: the tree vocabulary for inputs and outputs
(``tree``: container kinds, flatten with paths, rebuild, describe), input checks (``checks``),
warnings that point at the user's line (``warn``), ``PackedSequence`` cuts (``packed``) and
per-sample records moved by their own ``.to`` (``movable``).

Nothing here imports a pipeline stage.
"""

__all__: list[str] = []
