# Seed 000's mylib.py role: helpers train.py imports from its workspace (reading train.list / test.list and the
# dictionary prepare.py pickled).
import os
import pickle


def load_dict(path="word_dict.pickle"):
    with open(path, "rb") as f:
        return pickle.load(f)


def list_files(list_path):
    with open(list_path) as f:
        return [line.strip() for line in f if line.strip()]


def ngram_reader(files, word_dict, n):
    """Each line as <s> words <e>, every window of n word ids as a tuple (unknown words are <unk>)."""
    unk = word_dict["<unk>"]

    def reader():
        for path in files:
            with open(path) as f:
                for line in f:
                    ids = [word_dict.get(w, unk) for w in ["<s>"] + line.split() + ["<e>"]]
                    for i in range(n, len(ids) + 1):
                        yield tuple(ids[i - n:i])
    return reader


def my_shard(files, trainer_id):
    """The train.list file of this trainer: prepare.py split the data into SPLIT_COUNT files, one per trainer."""
    return [files[trainer_id % len(files)]] if files else []


def node_id():
    """The node index the launcher wrote into the workspace's nodefile."""
    with open(os.path.join(os.getcwd(), "nodefile")) as f:
        return int(f.read().strip())
