"""A store in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS, R2) through boto3.

The endpoint comes from `endpoint_url` or boto3's own `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`,
credentials from boto3's usual chain; neither is ever put into an error message.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import boto3
import botocore.exceptions as bex
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from s3transfer.exceptions import RetriesExceededError

from adapter_store.backends.base import (
    ObjectExistsError,
    ObjectMissingError,
    ObjectStat,
    Progress,
)
from adapter_store.errors import StoreAccessError, StoreError, StoreUnavailableError

T = TypeVar("T")
MB = 1024 * 1024
MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}
CONFLICT_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class _OrderedWriter:
    """Non-seekable wrapper: makes s3transfer deliver ranged parts in order (for hashing)."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out

    def write(self, data: bytes) -> int:
        return self._out.write(data)

    def seekable(self) -> bool:
        return False


class S3Backend:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        max_attempts: int = 3,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        transfer: TransferConfig | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        custom = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        config = Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # Path-style works on every S3-compatible server; AWS itself keeps its default.
            s3={"addressing_style": "path"} if custom else None,
            max_pool_connections=32,
        )
        session = boto3.session.Session()
        region = session.region_name or "us-east-1"
        self.client = session.client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        self.endpoint = self.client.meta.endpoint_url
        self.transfer = transfer or TransferConfig(
            multipart_threshold=8 * MB, multipart_chunksize=8 * MB, max_concurrency=10
        )

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _guard(self, fn: Callable[[], T], key: str = "") -> T:
        """Run one S3 call, translating boto errors into store errors a caller can act on."""
        where = f"{self.url} (endpoint {self.endpoint})"
        try:
            return fn()
        except (
            bex.HTTPClientError,
            bex.ConnectionError,
            RetriesExceededError,
            bex.IncompleteReadError,
        ) as exc:
            raise StoreUnavailableError(f"store {where} is unreachable: {exc}") from exc
        except (bex.NoCredentialsError, bex.PartialCredentialsError) as exc:
            raise StoreAccessError(
                f"no usable AWS credentials for store {where}: set AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role"
            ) from exc
        except bex.ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in MISSING_CODES:
                raise ObjectMissingError(key) from None
            if code in CONFLICT_CODES:
                raise ObjectExistsError(key) from None
            if code == "NoSuchBucket":
                raise StoreAccessError(f"bucket {self.bucket!r} does not exist at {where}") from exc
            if code in ACCESS_CODES:
                raise StoreAccessError(
                    f"store {where} refused access ({code}): check the credentials and the "
                    "bucket policy"
                ) from exc
            if status >= 500:
                raise StoreUnavailableError(f"store {where} failed ({code} {status})") from exc
            raise StoreError(f"store {where}: {code}: {err.get('Message', '')}") from exc

    def read_bytes(self, key: str) -> bytes:
        def get() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

        return self._guard(get, key)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}
        self._guard(
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, **extra
            ),
            key,
        )

    def upload_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        self._guard(
            lambda: self.client.upload_file(
                str(path), self.bucket, self._key(key), Callback=progress, Config=self.transfer
            ),
            key,
        )

    def download(
        self, key: str, out: BinaryIO, progress: Progress | None = None, size: int | None = None
    ) -> None:
        if size is not None and size < self.transfer.multipart_threshold:
            # Size known from the manifest: one GET, no HEAD round trip as s3transfer would do.
            self._guard(lambda: self._get_stream(key, out, progress), key)
            return
        self._guard(
            lambda: self.client.download_fileobj(
                self.bucket,
                self._key(key),
                _OrderedWriter(out),
                Callback=progress,
                Config=self.transfer,
            ),
            key,
        )

    def download_to(
        self, key: str, path: Path, progress: Progress | None = None, size: int | None = None
    ) -> None:
        if size is not None and size < self.transfer.multipart_threshold:
            with path.open("wb") as out:
                self._guard(lambda: self._get_stream(key, out, progress), key)
            return
        # Big objects: s3transfer's parallel ranged GETs written at their offsets.
        self._guard(
            lambda: self.client.download_file(
                self.bucket, self._key(key), str(path), Callback=progress, Config=self.transfer
            ),
            key,
        )

    def _get_stream(self, key: str, out: BinaryIO, progress: Progress | None) -> None:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        for chunk in body.iter_chunks(1024 * 1024):
            out.write(chunk)
            if progress:
                progress(len(chunk))

    def _pages(self, **kwargs: Any) -> list[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        return self._guard(lambda: list(paginator.paginate(Bucket=self.bucket, **kwargs)))

    def list_keys(self, prefix: str) -> list[str]:
        n = len(self.prefix)
        pages = self._pages(Prefix=self._key(prefix))
        return sorted(obj["Key"][n:] for page in pages for obj in page.get("Contents", []))

    def list_children(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        pages = self._pages(Prefix=full, Delimiter="/")
        return sorted(
            cp["Prefix"][len(full) :].rstrip("/")
            for page in pages
            for cp in page.get("CommonPrefixes", [])
        )

    def list_stats(self, prefix: str) -> dict[str, ObjectStat]:
        """Objects directly under `prefix` (a folder key ending in '/'), by name."""
        full = self._key(prefix)
        pages = self._pages(Prefix=full, Delimiter="/")
        return {
            obj["Key"][len(full) :]: ObjectStat(
                size=obj["Size"], tag=obj.get("ETag", ""), modified=obj["LastModified"]
            )
            for page in pages
            for obj in page.get("Contents", [])
            if obj["Key"] != full
        }

    def list_folder_stats(self, prefix: str) -> dict[str, dict[str, ObjectStat]]:
        """`list_stats` of every folder directly under `prefix`, by folder name, from one
        recursive listing (a LIST per thousand objects, not one per folder)."""
        full = self._key(prefix)
        out: dict[str, dict[str, ObjectStat]] = {}
        for page in self._pages(Prefix=full):
            for obj in page.get("Contents", []):
                folder, sep, leaf = obj["Key"][len(full) :].partition("/")
                if not sep or not leaf or "/" in leaf:
                    continue  # not a file directly inside a folder
                out.setdefault(folder, {})[leaf] = ObjectStat(
                    size=obj["Size"], tag=obj.get("ETag", ""), modified=obj["LastModified"]
                )
        return out

    def exists(self, key: str) -> bool:
        try:
            self._guard(
                lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)), key
            )
        except ObjectMissingError:
            return False
        return True

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            resp = self._guard(
                functools.partial(
                    self.client.delete_objects,
                    Bucket=self.bucket,
                    Delete={"Objects": batch, "Quiet": True},
                )
            )
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StoreError(f"could not delete {first.get('Key')}: {first.get('Message')}")

    def local_path(self, key: str) -> Path | None:
        return None
