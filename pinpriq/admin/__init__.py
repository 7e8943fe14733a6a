"""The admin listener: metrics, stats, a live dashboard, peek, purge and health over HTTP."""

from pinpriq.admin.listener import serve_admin

__all__ = ["serve_admin"]
