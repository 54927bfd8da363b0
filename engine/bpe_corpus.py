# ruff: noqa: E501  (the corpus is prose; its line lengths are data)
"""Embedded training text for the random checkpoints' byte-level BPE tokenizer (no downloads).

Original prose written for this project, mixed with code, numbers and some non-ASCII text (accents,
CJK, emoji) so that the tokenizer learns merges for common English and keeps rare multi-byte
characters split across several byte tokens, which is what exercises streaming detokenization.
"""

CORPUS = r"""
The quick brown fox jumps over the lazy dog. The lazy dog does not mind; it has seen the fox before.
A language model reads a sequence of tokens and predicts the next one. When the prompt is long, the
model spends most of its time in the prefill phase, where every token of the prompt is processed at
once and the work is bound by compute. When the answer is long, the model spends its time in the
decode phase, where one token is produced per step and the work is bound by memory bandwidth.
Serving both phases on the same machine means that a long prompt can stall everybody else's answer.
Disaggregated serving splits the two phases across two pools of machines. The prefill pool turns
prompts into key and value tensors, the cache, and sends them to the decode pool over the network.
The decode pool keeps the cache in blocks of sixteen tokens and generates the answer token by token.
A router in front of both pools decides where each request goes. It prefers a decode worker that
already holds the conversation, because reusing the cache of the earlier turns saves time and money.

Once upon a time there was a small village at the edge of a great forest. The people of the village
were farmers, bakers, weavers and smiths. Every morning the baker lit the oven before the sun rose,
and every evening the children ran to the river to watch the boats come home. One winter the river
froze, and the boats could not come home, so the village had to share what it had until the spring.
They learned that a good story, told slowly by the fire, can make a long night feel short.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i), i * i, i ** 3)

class Block:
    def __init__(self, block_id, ref_count=0):
        self.block_id = block_id
        self.ref_count = ref_count

{"id": 42, "name": "block", "size": 16, "tokens": [1, 2, 3, 5, 8, 13], "ok": true, "value": null}
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY count(*) DESC;

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192 65536 3.14159 2.71828
Dates and times: 2024-01-15 12:30:45, Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Units: 16 GB of memory, 80 GB of HBM, 400 Gb/s of network, 1.5 ms of latency, 99.9 percent of uptime.

Questions and answers. What is the capital of France? The capital of France is Paris. What is two
plus two? Two plus two is four. Why is the sky blue? Sunlight is scattered by the air, and blue light
is scattered more than red light. How many days are in a week? There are seven days in a week.
Who wrote this text? It was written for a test, to train a small tokenizer that fits in a file.

Voilà un café très agréable à Zürich, où l'on parle français, Deutsch und ein bisschen Englisch.
El niño comió una manzana en la mañana. São Paulo é uma cidade enorme. Ça va? Ja, natürlich!
Привет, мир! Как дела? Это небольшой текст на русском языке.
日本語のテキストも少し入れておきます。東京は大きな都市です。
中文也有一点：你好，世界！今天天气很好。
한국어 문장도 하나 있습니다. 안녕하세요!
Emoji: 🙂 😀 🚀 🦊 🐶 ✨ ❤️ 👍🏽 — and symbols: € £ ¥ © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ √ π Ω µ → ← ↑ ↓ • … “quoted” ‘single’.

The end. Thank you for reading, and have a good day! Good morning, good evening, good night.
"""
