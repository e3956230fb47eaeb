"""``python -m d9dfn._torch``: print ``docs/design/torch-internals.md`` as the table renders it."""

from d9dfn._torch._doc import render
from d9dfn._torch._table import PATCHES

print(render(PATCHES), end="")
