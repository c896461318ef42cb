"""Starting the engine child: plain Popen, importing nothing heavy, so that the child starts before
asyncio and the HTTP stack are even imported and the engine loads while they do."""
import subprocess


def spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)  # a Ctrl-C meant for us must not kill it before we answer
