"""Token vocabulary shared by the policy and the reward model (seed-compatible ids).

Prompt   = [<family>, v_a1, v_a2, v_a3, v_a4, <sep>]  (6 tokens)
Response = 8 content tokens.
"""
from __future__ import annotations

FAMILIES = ["anvil", "birch", "cobalt", "dune", "ember", "fjord"]
PILOT_MIX = {"anvil": 444, "birch": 458, "cobalt": 433, "dune": 48, "ember": 195, "fjord": 422}
"""The pilot dev set's family mix (the seed's); deployment traffic is balanced."""
N_ATTR = 4
N_VAL = 8
CONTENT = ["ba", "da", "fa", "ga", "ha", "ja", "ka", "la", "ma", "na", "pa", "ra",
           "sa", "ta", "va", "wa", "za", "be", "de", "fe", "ge", "he", "je", "ke"]
RESP_LEN = 8
PROMPT_LEN = N_ATTR + 2
SEQ_LEN = PROMPT_LEN + RESP_LEN

TOKENS = ["<pad>", "<sep>"] + [f"<{f}>" for f in FAMILIES] + [f"v{i}" for i in range(N_VAL)] + CONTENT
TOK2ID = {t: i for i, t in enumerate(TOKENS)}
PAD, SEP = 0, 1
FAM_ID = {f: TOK2ID[f"<{f}>"] for f in FAMILIES}
VAL_ID = [TOK2ID[f"v{i}"] for i in range(N_VAL)]
CONTENT_ID = [TOK2ID[c] for c in CONTENT]
CONTENT_LO, CONTENT_HI = CONTENT_ID[0], CONTENT_ID[-1] + 1  # content ids are contiguous
N_CONTENT = len(CONTENT)


def encode_prompt(family: str, attrs: list[int]) -> list[int]:
    return [FAM_ID[family]] + [VAL_ID[a] for a in attrs] + [SEP]


def decode_prompt(ids: list[int]) -> tuple[str, list[int]]:
    fam = TOKENS[ids[0]][1:-1]
    return fam, [int(TOKENS[i][1:]) for i in ids[1:1 + N_ATTR]]


def encode_response(tokens: list[str]) -> list[int]:
    return [TOK2ID[t] for t in tokens]


def decode_response(ids) -> list[str]:
    return [TOKENS[int(i)] for i in ids]


def prompt_from_record(rec: dict) -> list[int]:
    return encode_prompt(rec["family"], rec["attrs"])
