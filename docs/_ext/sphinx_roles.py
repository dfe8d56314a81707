"""Griffe extension: Sphinx roles become links, ``Example:`` sections become code.

The docstrings of jdls are Google style, with Sphinx-style cross references such as
``:class:`DynamicScale``` or ``:meth:`~jdls.DynamicScale.check```, which read well in
``help()``. mkdocstrings would print them verbatim. This extension rewrites each one, once the
package is loaded, to an autorefs link (``[`DynamicScale`][jdls.DynamicScale]``) when the
target is a public object of the package, and to plain code otherwise.

Reference-style web links (```text <https://...>`_``) become Markdown links. It also
renames ``Example:`` section headers to ``Examples:``: Griffe's Google-style parser
turns the ``>>>`` lines of an ``Examples`` section into highlighted code, but treats a
singular ``Example`` as a note and would render the ``>>>`` lines as nested quotes.

Used by ``mkdocs.yml`` (``handlers.python.options.extensions``); not part of the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_RST_LINK = re.compile(r"`(?P<text>[^`<]+?)\s*<(?P<url>https?://[^>`]+)>`__?")
_EXAMPLE_HEADER = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`(?P<tilde>~?)(?P<target>[^`]+)`"
)


def _public(path: str) -> bool:
    return not any(part.startswith("_") for part in path.split("."))


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._pkg = pkg
        for obj in self._walk(pkg, set()):
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite(obj.docstring.value, obj)

    def _rewrite(self, value: str, obj: griffe.Object) -> str:
        value = _ROLE.sub(lambda m: self._replace(m, obj), value)
        value = _RST_LINK.sub(r"[\g<text>](\g<url>)", value)
        return _EXAMPLE_HEADER.sub(r"\g<indent>Examples:", value)

    def _walk(self, obj: griffe.Object, seen: set[str]) -> Any:
        if obj.path in seen:
            return
        seen.add(obj.path)
        yield obj
        for member in obj.members.values():
            if isinstance(member, griffe.Alias):
                continue
            yield from self._walk(member, seen)

    def _find(self, path: str) -> griffe.Object | griffe.Alias | None:
        parts = path.split(".")
        if parts[0] != self._pkg.name:
            return None
        node: Any = self._pkg
        for part in parts[1:]:
            try:
                node = node.members[part]
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                return None
        return node

    def _public_path(self, found: Any) -> str | None:
        """The path of ``found`` under which the API reference renders it."""
        try:
            canonical = found.canonical_path if isinstance(found, griffe.Alias) else found.path
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        parts = canonical.split(".")
        # jdls._scales.scale.DynamicScale.check -> jdls.DynamicScale.check when jdls exports it.
        for i in range(len(parts) - 1, 0, -1):
            head = parts[i]
            if head in self._pkg.members and not head.startswith("_"):
                candidate = ".".join([self._pkg.name, *parts[i:]])
                if self._find(candidate) is not None and _public(candidate):
                    return candidate
        return canonical if _public(canonical) else None

    def _replace(self, match: re.Match[str], obj: griffe.Object) -> str:
        target = match["target"].strip()
        text = target.rsplit(".", 1)[-1] if match["tilde"] else target
        scopes = [obj.path, obj.module.path, self._pkg.name]
        if obj.parent is not None:
            scopes.insert(1, obj.parent.path)
        for scope in [None, *scopes]:
            path = target if scope is None else f"{scope}.{target}"
            found = self._find(path)
            if found is not None:
                public = self._public_path(found)
                if public is not None:
                    return f"[`{text}`][{public}]"
                break
        return f"`{text}`"
