"""The share scrubber finds secrets by their shape, wherever they appear in a result's text: keys and tokens of
the common services, private-key blocks, JSON web tokens, cloud secret keys and Slurm node lists."""

from __future__ import annotations

import pytest

from checks.share.scrub import REDACTED, Scrubber

JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAE\n-----END OPENSSH PRIVATE KEY-----"


@pytest.mark.parametrize("text, secret, kind", [
    (f"Authorization failed for {JWT} at login", JWT, "token"),
    (f"loaded key\n{KEY}\nthen", "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAE", "private key"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA7 (truncated)", "MIIEpAIBAAKCAQEA7", "private key"),
    ("GOOGLE_API_KEY=AIzaSyD3x4mpl3K3yV4lu3F0rT3st1ngOnly123", "AIzaSyD3x4mpl3K3yV4lu3F0rT3st1ngOnly123", "credential"),
    ("stripe sk_live_4eC39HqLyjWDarjtT1zdp7dc in env", "sk_live_4eC39HqLyjWDarjtT1zdp7dc", "credential"),
    ('aws_secret_access_key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"', "wJalrXUtnFEMI/K7MDENG", "credential"),
    ("srun: nodes gpu-node[01-08,12] allocated", "gpu-node[01-08,12]", "node list"),
    ("NodeList=dgx[3,5]", "dgx[3,5]", "node list"),
])
def test_secret_is_removed_by_its_shape(text: str, secret: str, kind: str) -> None:
    s = Scrubber()
    out = s.text(text)
    assert secret not in out and (REDACTED in out or "<nodes>" in out), out
    assert s.counts[kind] >= 1, s.counts


@pytest.mark.parametrize("text", [
    "torch comes from https://download.pytorch.org/whl/cu130",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>",
    "flashinfer 0.7.4 requires cuda-python>=12.0",
    "IndexError in rank_data[0] and buffer_ptrs[1]",
])
def test_ordinary_text_is_kept(text: str) -> None:
    assert Scrubber().text(text) == text


def test_a_bare_cloud_secret_is_removed_after_any_word_and_separator() -> None:
    """Forty base64 characters of AWS's secret-key shape, after a plain word and each separator text puts
    between a name and its value (a space, a colon, an assignment's =, quotes, brackets), at any end."""
    import random
    import string

    rng = random.Random(55)
    alphabet = string.ascii_letters + string.digits + "+/"
    kept = []
    for word in ("the", "key", "aws", "note", "KEY", "x", "then"):
        for sep in (" ", ": ", "=", " '", '"', "(", "[", "\t", ",", " -"):
            for end in ("", " end", ".", ",", ")", '"', "\n"):
                key = "".join(rng.choice(alphabet) for _ in range(37)) + rng.choice("ABC") + "x7"
                s = Scrubber()
                if key in s.text(word + sep + key + end):
                    kept.append(word + sep + key + end)
    assert kept == []


def test_a_commit_or_a_hash_beside_an_assignment_is_kept() -> None:
    for text in ("commit=" + "0123456789abcdef" * 2 + "01234567", "sha=" + "A1B2C3D4E5" * 4):
        assert Scrubber().text(text) == text
