"""lm-eval's word perplexity of an exported model on a prepared corpus's held-out documents.

    python -m tests.support.held_out_lm_eval HF_DIR CORPUS_DIR TEXT_DIR WORK_DIR OUT.json

The task is a local `loglikelihood_rolling` perplexity task, as lm-eval's wikitext is: one
document per held-out file that `CORPUS_DIR/stats.json` names (read from TEXT_DIR), scored
whole in rolling windows of the run's sequence length. The model runs through lm-eval's
own `HFLM` on the CPU in fp32, each document's first token conditioned on the end-of-document
token, as after the document before it in Megatron's token stream. Offline: the dataset is
a local JSON file, every Hugging Face cache under WORK_DIR. Writes lm-eval's word
perplexity and the word count lm-eval divides by (its own `count_words`).
"""

from __future__ import annotations

import json
import os
import sys

TASK = """task: held_out
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def main() -> None:
    model_dir, corpus, text_dir, work, out = sys.argv[1:6]
    os.makedirs(work, exist_ok=True)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=os.path.join(work, "hf"))
    names = json.load(open(os.path.join(corpus, "stats.json"), encoding="utf-8"))["splits"]["valid"]["names"]
    docs = [open(os.path.join(text_dir, name), encoding="utf-8").read() for name in names]
    with open(os.path.join(work, "held_out.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    with open(os.path.join(work, "held_out.yaml"), "w", encoding="utf-8") as f:
        f.write(TASK.format(docs=os.path.join(work, "held_out.jsonl")))

    import lm_eval
    import transformers
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = HFLM(pretrained=model_dir, backend="causal", device="cpu", dtype="float32", batch_size=16,
                 max_length=config.max_position_embeddings, prefix_token_id=config.eos_token_id)
    results = lm_eval.simple_evaluate(model=model, tasks=["held_out"],
                                      task_manager=TaskManager(include_path=work, include_defaults=False))
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"word_perplexity": results["results"]["held_out"]["word_perplexity,none"],
                   "words": sum(ConfigurableTask.count_words(doc) for doc in docs), "documents": len(docs)}, f)


if __name__ == "__main__":
    main()
