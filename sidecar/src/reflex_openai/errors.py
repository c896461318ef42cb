"""Errors answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations


class APIError(Exception):
    """An error answered in OpenAI's format, with its HTTP status (and headers, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def type_error(name: str, expected: str) -> APIError:
    return bad(f"Invalid type for '{name}': expected {expected}", name, "invalid_type")
