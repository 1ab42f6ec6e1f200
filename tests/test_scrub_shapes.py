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
