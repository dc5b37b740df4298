"""Helpers every stage uses, below all of them: the tree vocabulary for inputs and outputs
(``kinds``: container kinds, children and paths; ``rebuild``: a container rebuilt with its own
type; ``tree``: flatten with paths, unflatten and the other walks; ``describe``: values as text
for messages), input checks (``checks``), warnings that point at the user's line (``warn``),
``PackedSequence`` cuts (``packed``) and per-sample records moved by their own ``.to``
(``movable``).

Nothing here imports a pipeline stage.
"""

__all__: list[str] = []
