"""stderr_to: fd 2 itself is redirected (what C code writes there too), and put back, also after an error."""
import os

import pytest

from nanovllm.utils.stderr_fd import stderr_to

pytestmark = pytest.mark.cpu_only     # file descriptors only


def test_fd_2_goes_to_the_given_fd_and_comes_back(tmp_path, capfd):
    path = tmp_path / "err.txt"
    with open(path, "wb") as sink:
        with stderr_to(sink.fileno()):
            os.write(2, b"inside\n")
        os.write(2, b"outside\n")
        with pytest.raises(ValueError):
            with stderr_to(sink.fileno()):
                raise ValueError("an error inside")
        os.write(2, b"after the error\n")
    assert path.read_bytes() == b"inside\n"
    assert capfd.readouterr().err == "outside\nafter the error\n"
