"""Image references, normalized as Docker reads them, and the allow-list matched on them.

Control plane. A job's ``image`` is a Docker reference: ``[REGISTRY/]REPOSITORY[:TAG][@DIGEST]``.
The engine reads it by the rules of ``distribution/reference``, and so does hora, before any
pattern is matched:

* the first ``/``-separated component is a registry only if it contains a ``.`` or a ``:``,
  or is ``localhost``; otherwise the registry is ``docker.io``;
* on ``docker.io`` a one-component repository gets the ``library/`` prefix;
* no tag and no digest means the tag ``latest``.

So ``hora:cpu`` is ``docker.io/library/hora:cpu``, ``hora:5000/evil/miner`` is the repository
``evil/miner`` on the registry ``hora:5000``, and ``hora-x/miner`` is ``docker.io/hora-x/miner``.
Allow-list patterns (setting ``docker_allowed_images``) are normalized by the same rules and
matched against the normalized reference with ``*`` and ``?`` never crossing a ``/``: ``hora:*``
means the images named ``hora`` (hora's own, built on the engine by ``hora image build``) and
nothing on another registry or in another repository. A pattern that names no registry allows
only images the engine already has (never pulled, see :meth:`ImageRef.pullable`). A pattern
may also be an image ID (``sha256:<64 hex>``), allowing that image whatever it is called.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from hora.errors import SpecError

DEFAULT_REGISTRY = "docker.io"
# distribution/reference's grammar (lower-case path components, tag, digest)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_DOMAIN = re.compile(
    r"^(?:localhost|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*)(?::[0-9]+)?$"
)
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,}$")
IMAGE_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImageRef:
    """One normalized image reference.

    Example:
        >>> ref = ImageRef.parse("hora:cpu")
        >>> ref.registry, ref.repository, ref.tag, str(ref)
        ('docker.io', 'library/hora', 'cpu', 'docker.io/library/hora:cpu')
        >>> ImageRef.parse("hora:5000/evil/miner").registry
        'hora:5000'
    """

    registry: str
    repository: str
    tag: str | None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> ImageRef:
        """Parse and normalize ``text`` (see the module docstring).

        Raises:
            SpecError: (field ``image``) not a valid reference, with what is wrong.
        """
        if not text or len(text) > 512 or not text.isprintable() or text != text.strip():
            raise SpecError("image", "must be an image reference of printable characters")
        name, digest = _split_digest(text)
        registry, rest = _split_registry(name)
        repository, tag = _split_tag(rest)
        if not _DOMAIN.match(registry):
            raise SpecError("image", f"{registry!r} is not a registry host[:port]")
        if not _PATH.match(repository):
            raise SpecError(
                "image",
                f"repository {repository!r} is not valid (lower-case letters, digits and "
                "'.', '_', '-' separators, in '/'-separated components)",
            )
        if tag is not None and not _TAG.match(tag):
            raise SpecError("image", f"tag {tag!r} is not valid")
        if tag is None and digest is None:
            tag = "latest"
        return cls(registry, repository, tag, digest)

    @property
    def name(self) -> str:
        """``registry/repository``."""
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag is not None else ""
        digest = f"@{self.digest}" if self.digest is not None else ""
        return f"{self.name}{tag}{digest}"

    def allowed(self, patterns: Sequence[str], image_id: str | None = None) -> bool:
        """Whether a pattern allows this reference (or, once resolved, the image ``image_id``).

        Example:
            >>> ImageRef.parse("hora:cpu").allowed(["hora:*"])
            True
            >>> ImageRef.parse("hora-x/miner").allowed(["hora:*", "hora-*:*"])
            False
        """
        return self.matching(patterns, image_id) is not None

    def matching(self, patterns: Sequence[str], image_id: str | None = None) -> str | None:
        """The first pattern that allows this reference, or None.

        A name pattern's ``registry/repository`` must match; then its tag must match the
        reference's tag (``*`` also allows a reference by digest alone) and its digest, if
        it has one, the reference's digest. A pattern without tag or digest allows every
        tag and digest. An image-ID pattern must equal ``image_id``.
        """
        for pattern in patterns:
            if IMAGE_ID.match(pattern):
                if image_id == pattern:
                    return pattern
            elif _matches(pattern, self):
                return pattern
        return None

    def pullable(self, patterns: Sequence[str]) -> bool:
        """Whether a pattern that allows this reference names its registry.

        A pattern written without a registry (``hora:*``) allows only images the engine
        already has: hora never pulls them, so ``hora:*`` cannot fetch an image called
        ``hora`` from Docker Hub. To allow pulls, name the registry
        (``docker.io/library/python:3.11*``, ``ghcr.io/acme/*:*``).

        Example:
            >>> ImageRef.parse("hora:cpu").pullable(["hora:*"])
            False
            >>> ImageRef.parse("ghcr.io/acme/x:1").pullable(["ghcr.io/acme/*:*"])
            True
        """
        return any(
            names_registry(p) and self.matching([p]) is not None
            for p in patterns
            if not IMAGE_ID.match(p)
        )


def names_registry(pattern: str) -> bool:
    """Whether a pattern (or reference) names its registry explicitly.

    Example:
        >>> names_registry("hora:*"), names_registry("localhost/x:*"), names_registry("a/b")
        (False, True, False)
    """
    first, slash, _ = pattern.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def normalize_pattern(pattern: str) -> str:
    """A pattern as written, in the normalized form it is matched in.

    Example:
        >>> normalize_pattern("hora:*"), normalize_pattern("ghcr.io/acme/*")
        ('docker.io/library/hora:*', 'ghcr.io/acme/*')
    """
    if IMAGE_ID.match(pattern):
        return pattern
    name, digest = _split_digest(pattern)
    registry, rest = _split_registry(name)
    repository, tag = _split_tag(rest)
    text = f"{registry}/{repository}"
    if tag is not None:
        text += f":{tag}"
    if digest is not None:
        text += f"@{digest}"
    return text


def check_pattern(pattern: str) -> str:
    """``pattern`` if it is usable in ``docker_allowed_images``.

    Raises:
        ValueError: empty, not printable, or with characters no reference has.
    """
    if not pattern or not pattern.isprintable() or re.search(r"[\s\[\]{}\\]", pattern):
        raise ValueError(f"image pattern {pattern!r} is not a reference with * and ?")
    try:
        normalize_pattern(pattern)
    except SpecError as e:
        raise ValueError(f"image pattern {pattern!r}: {e.message}") from None
    return pattern


def _glob(pattern: str) -> re.Pattern[str]:
    """``*`` and ``?`` that never cross a ``/``; everything else literal."""
    parts = ["[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in pattern]
    return re.compile("^" + "".join(parts) + "$")


def _matches(pattern: str, ref: ImageRef) -> bool:
    name, digest = _split_digest(pattern)
    registry, rest = _split_registry(name)
    repository, tag = _split_tag(rest)
    if not _glob(f"{registry}/{repository}").match(ref.name):
        return False
    if digest is not None and not (ref.digest and _glob(digest).match(ref.digest)):
        return False
    if tag is None:
        return True
    if ref.tag is None:
        return tag == "*"
    return bool(_glob(tag).match(ref.tag))


def _split_digest(text: str) -> tuple[str, str | None]:
    name, at, digest = text.partition("@")
    if not at:
        return text, None
    if not _DIGEST.match(digest) and "*" not in digest and "?" not in digest:
        raise SpecError("image", f"digest {digest!r} is not ALGORITHM:HEX (sha256:...)")
    return name, digest


def _split_registry(name: str) -> tuple[str, str]:
    first, slash, rest = name.partition("/")
    if first == "index.docker.io":
        first = DEFAULT_REGISTRY
    if slash and ("." in first or ":" in first or first == "localhost"):
        if first == DEFAULT_REGISTRY and "/" not in rest:
            return DEFAULT_REGISTRY, f"library/{rest}"
        return first, rest
    if not slash:
        return DEFAULT_REGISTRY, f"library/{name}"
    return DEFAULT_REGISTRY, name


def _split_tag(rest: str) -> tuple[str, str | None]:
    last = rest.rsplit("/", 1)[-1]
    if ":" not in last:
        return rest, None
    repository, _, tag = rest.rpartition(":")
    return repository, tag
