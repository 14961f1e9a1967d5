"""The docker runtime's images: refused at submission by name, resolved by ID at start.

Control plane. :func:`check_image` refuses what the allow-list does not allow (matched on the
normalized reference, see :mod:`hora_service.runtimes.imageref`) and, for a reference by digest that
will not be pulled, a digest the engine lacks: a 422 naming ``image`` either way, never an
engine's error at start. :func:`resolve_image` finds the image on the engine (pulling it
only where the policy and a pattern naming its registry allow) and answers its ID, from
which the container is created: it runs exactly the image resolved, even if the name is
re-tagged meanwhile. The engine's errors are shortened to what it said.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import docker
import docker.errors
import requests.exceptions
from hora.errors import HoraError, SpecError

from hora_service.runtimes.imageref import IMAGE_ID, ImageRef

# what the engine's errors look like when it cannot be reached
UNREACHABLE = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


class DockerEngineError(HoraError):
    """The Docker engine cannot do what an attempt needs (down, image missing, refused)."""


class ImagePolicy(Protocol):
    """What the image checks need of the docker settings (:class:`DockerConfig`)."""

    @property
    def allowed_images(self) -> tuple[str, ...]: ...  # noqa: D102

    @property
    def pull(self) -> str: ...  # noqa: D102

    def allows(self, image: str) -> bool: ...  # noqa: D102

    def pulls(self, image: str) -> bool: ...  # noqa: D102


def check_image(client: Callable[[], Any], policy: ImagePolicy, image: str | None) -> None:
    """Refuse at submission an image this service will not run.

    ``client`` gives the engine's client; it is asked for only for a reference by digest.

    Raises:
        SpecError: (field ``image``) none named, not allowed, or a digest the engine lacks
            and will not pull.
    """
    if image is None:
        raise SpecError("image", "the docker runtime needs an image (--image)")
    if not policy.allows(image):
        allowed = ", ".join(policy.allowed_images) or "none"
        shown = image if IMAGE_ID.match(image) else str(ImageRef.parse(image))
        raise SpecError(
            "image",
            f"image {image!r} ({shown}) is not allowed on this service (allowed: {allowed}); "
            "an admin can add patterns to HORA_DOCKER_ALLOWED_IMAGES",
        )
    if "@" not in image or policy.pulls(image):
        return
    try:
        client().images.get(image)
    except docker.errors.ImageNotFound:
        why = "is not on the Docker engine, and this service does not pull it"
        raise SpecError("image", f"image {image!r} {why}; name a digest it has") from None
    except UNREACHABLE:
        pass  # the engine is down: the attempt fails with that reason when it starts


def resolve_image(client: Any, policy: ImagePolicy, image: str) -> tuple[str, list[str]]:
    """The image's ID and environment, pulling it first where the policy allows.

    Raises:
        DockerEngineError: not on the engine and not to be pulled, or the pull failed (with what
            the registry said).
    """
    try:
        found = client.images.get(image)
    except docker.errors.ImageNotFound:
        if policy.pull == "never":
            raise DockerEngineError(
                f"image {image!r} is not on the Docker engine and the pull policy is never"
            ) from None
        if not policy.pulls(image):
            raise DockerEngineError(
                f"image {image!r} is not on the Docker engine, and the pattern that allows "
                "it names no registry: such images are never pulled"
            ) from None
        try:
            found = client.images.pull(image)
        except UNREACHABLE as e:
            raise DockerEngineError(f"cannot pull image {image!r}: {engine_says(e)}") from None
    env = (found.attrs.get("Config") or {}).get("Env") or []
    return str(found.id), [str(e) for e in env]


def engine_says(e: BaseException) -> str:
    """What the engine said, without the HTTP status line of the SDK's message."""
    explanation = getattr(e, "explanation", None)
    return short(Exception(explanation)) if explanation else short(e)


def short(e: BaseException) -> str:
    """The first line of an error's text, at most 300 characters."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
