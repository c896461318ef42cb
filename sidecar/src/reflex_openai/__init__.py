"""OpenAI-compatible HTTP front door over one `reflex stdio` child process."""
__version__ = "0.1.0"
