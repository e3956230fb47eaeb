"""``docs/design/torch-internals.md``, rendered from the table.

Regenerate with ``python -m d9dfn._torch > docs/design/torch-internals.md``; ``tests/test_torch_patches.py`` fails
while the committed page differs."""

from __future__ import annotations

from collections.abc import Sequence

from d9dfn._torch._gate import CPP_BUILDS_ENV, ENV, Patch

__all__ = ["render"]

_HEAD = f"""<!-- Generated from d9dfn/_torch/_table.py by `python -m d9dfn._torch > docs/design/torch-internals.md`;
tests/test_torch_patches.py fails while this page differs from what that prints. Edit the table, not this page. -->

# Torch internals: one room, one table, one switch

d9dfn's cold start leans on torch's private API: inductor's C++ builds batched and made safe to kill, its vector-ISA
check shortened, the backward lowered early, region schemas remembered, a code object per compiled piece, the head's
graph cached. Each of these changes what torch does, and a torch upgrade can move the private pieces they rest on. So
they all live in one package, `d9dfn/_torch/` (the ground floor of the core: it imports nothing of d9dfn), each a
row of one table (`d9dfn/_torch/_table.py`, the table below), behind one switch and a version gate. The rest of
d9dfn calls the seam (`d9dfn._torch`), never torch's private modules for these.

## The switch

`{ENV}` decides which rows are on, for the whole process:

| value | rows on |
|---|---|
| unset, `all`, `on` | every row the gate lets in |
| `off`, `none`, `0` | none: torch as torch ships it (the `required` rows stay: they are what a feature means) |
| `a,b` | those rows |
| `-a,-b` | every row but those |

A name that is no row's is refused when the first step is built, naming the rows. `{CPP_BUILDS_ENV}=0` (the older
switch, kept) leaves out `cpp_builds_batched`, `compile_pool_off` and `backward_lowered_early` whatever `{ENV}` says.

## The version gate

Each row names the torch versions it was verified on (its tests passed there). On such a torch it installs
silently. On any other, its capability check (does this torch have the pieces the row relies on, in the shape it
expects?) decides: the row installs with one warning line naming the torch version and the row, or it is left out
with one warning line saying so and naming `{ENV}`. A row never turns itself off silently.

## Which torch

`pyproject.toml` declares `torch>=2.13,<2.14`: the range tested, CI's pin (`constraints.txt`, 2.13.0). The project's
GPU machines run torch 2.11.0 (`docs/design/gpu.md`), outside that range: d9dfn runs there from the checkout, and
there every row goes through its capability check (one warning line each); which rows pass it there has not been
recorded. A new torch: run `tests/test_torch_patches.py` and the rows' tests on it, add its version to the rows that
pass, and widen the range.

## Kinds

- `process`: installed once (the first step builder with an inductor backend, or `run_compile_cache`), changes
  torch for the whole process; `d9dfn._torch.uninstall()` puts torch's own objects back.
- `scoped`: a torch setting or attribute changed only inside a d9dfn call, while the row is on.
- `action`: work torch does anyway, started earlier by d9dfn; no torch attribute changed.
- `required`: a setting or hook a d9dfn feature needs to be correct; no switch (turning it off would change results,
  not speed). Listed so that a torch upgrade checks them too.

## The table
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(patches: Sequence[Patch]) -> str:
    """The page for ``patches``."""
    lines = [_HEAD]
    lines.append("| row | kind | touches | verified on | upstream | switch off | test |")
    lines.append("|---|---|---|---|---|---|---|")
    for p in patches:
        touches = "<br>".join(f"`{t}`" for t in p.touches)
        test = f"`{p.test}`"
        lines.append(
            f"| `{p.name}` | {p.kind} | {touches} | {', '.join(p.verified)} | {_cell(p.upstream)} | "
            f"{' or '.join(f'`{s}`' for s in p.switches) or 'none (required)'} | {test} |"
        )
    lines.append("")
    lines.append("## What each row does")
    lines.append("")
    for p in patches:
        lines.append(f"- **`{p.name}`** (`d9dfn/_torch/{p.module}.py`): {p.summary}")
    lines.append("")
    return "\n".join(lines)
