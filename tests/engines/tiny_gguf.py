"""Write the tiny random-weight Llama GGUF the real llama.cpp suite serves (tests/real_llamacpp).

Usage: tiny_gguf.py PATH, with an interpreter that has `gguf` and numpy (the venv of
tests/engines/llamacpp.sh). Nothing is downloaded: the weights are seeded random numbers, the
vocabulary is a SentencePiece-style one written here (three special tokens, the 256 byte
tokens SentencePiece's byte fallback needs, printable ASCII and a hundred words with their
prefixes: 578 pieces), the chat template a plain Jinja one. The same 7 MB file every time, in
about a second.

Two properties the suite relies on, built into the weights rather than asked of each request:
- the model never ends an answer on its own: every answer runs to `max_tokens`;
- it never emits a byte token, so every token is whole text: llama-server writes one event
  per token (it holds back a token that ends inside a UTF-8 sequence), which is what lets a
  streaming client's close be noticed at the next token.
Both come from one residual dimension held constant: every token embedding has the same
positive value in dimension 0 and no layer writes to it, so after the final norm that
dimension is positive for every position; the output rows of the special and byte tokens
are strongly negative there and zero elsewhere, so their logits sit far below every other.
"""

from __future__ import annotations

import pathlib
import string
import sys

import gguf
import numpy as np

SEED = 30
# Big enough that a 2048-token prompt batch takes more than a second on one core (so a client
# can leave during prefill; measured 1.3 s, and 2.3 ms a token at a short context), small
# enough to write in a second.
EMBEDDING = 256
FEED_FORWARD = 768
LAYERS = 4
HEADS = 4
KV_HEADS = 2
CONTEXT = 32768
# The value dimension 0 holds everywhere, and how far below the others the banned logits go.
HELD = 4.0
BANNED = -64.0
WORDS = (
    "the and a of to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find story tell "
    "once upon"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and token types: <unk>, <s>, </s>, the byte tokens, single characters
    (space as SentencePiece's "▁"), then words with their leading "▁", scored so that longer
    pieces win the merges."""
    token_type = gguf.TokenType
    pieces = ["<unk>", "<s>", "</s>"]
    types = [token_type.UNKNOWN, token_type.CONTROL, token_type.CONTROL]
    pieces += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [token_type.BYTE] * 256
    characters = [("▁" if c == " " else c) for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    pieces += characters
    types += [token_type.NORMAL] * len(characters)
    # SentencePiece merges pairs only into pieces that exist: each word's prefixes too.
    words: list[str] = []
    for word in WORDS:
        for end in range(2, len(word) + 2):
            prefix = "▁" + word[: end - 1]
            if prefix not in words and prefix not in pieces:
                words.append(prefix)
    pieces += words
    types += [token_type.NORMAL] * len(words)
    scores = [0.0] * len(pieces)
    for index, piece in enumerate(pieces):
        if types[index] == token_type.NORMAL:
            scores[index] = float(len(piece))
    return pieces, scores, [int(t) for t in types]


def write(path: pathlib.Path) -> None:
    rng = np.random.default_rng(SEED)
    pieces, scores, types = vocabulary()
    vocab = len(pieces)
    head_dim = EMBEDDING // HEADS

    def matrix(rows: int, columns: int) -> np.ndarray:
        """Rows x columns (output x input, as GGUF stores a weight), F16, scaled so that a
        product keeps unit variance."""
        return (rng.standard_normal((rows, columns)) / np.sqrt(columns)).astype(np.float16)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tether-tiny-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    embeddings = rng.standard_normal((vocab, EMBEDDING)).astype(np.float16)
    embeddings[:, 0] = HELD
    writer.add_tensor("token_embd.weight", embeddings)
    ones = np.ones(EMBEDDING, dtype=np.float32)
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        attn_output = matrix(EMBEDDING, EMBEDDING)
        ffn_down = matrix(EMBEDDING, FEED_FORWARD)
        # Nothing writes into dimension 0 of the residual stream: it stays HELD.
        attn_output[0, :] = 0
        ffn_down[0, :] = 0
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        writer.add_tensor(f"{block}.attn_q.weight", matrix(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{block}.attn_k.weight", matrix(KV_HEADS * head_dim, EMBEDDING))
        writer.add_tensor(f"{block}.attn_v.weight", matrix(KV_HEADS * head_dim, EMBEDDING))
        writer.add_tensor(f"{block}.attn_output.weight", attn_output)
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", matrix(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_up.weight", matrix(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_down.weight", ffn_down)
    writer.add_tensor("output_norm.weight", ones)
    output = matrix(vocab, EMBEDDING) * np.float16(2.0)
    output[:, 0] = 0
    banned = [index for index, kind in enumerate(types) if kind != gguf.TokenType.NORMAL]
    output[banned, :] = 0
    output[banned, 0] = BANNED
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_gguf.py PATH")
    path = pathlib.Path(sys.argv[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(vocabulary()[0])} pieces)")


if __name__ == "__main__":
    main()
