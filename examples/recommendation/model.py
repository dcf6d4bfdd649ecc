"""The two-tower rating model, shared by train.py and infer.py (stdlib + numpy + paddle_cluster.ps).

User tower: user-id embedding ++ one-hot(gender, age bucket, occupation) -> FC -> u.
Movie tower: movie-id embedding ++ mean-pooled genre embeddings ++ mean-pooled title-word embeddings -> FC -> v.
Rating: ``mu + b_user + b_movie + u . v``. The four embedding tables are sparse pserver tables; the user and
movie tables carry their bias in an extra last column, so one pull per table brings both. The small
categorical user features are a one-hot block into the tower's FC (a dense embedding in effect).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
from movielens import N_AGE, N_GENDER, Dataset

from paddle_cluster.train.layers import Concat, Embedding, Layer, Linear, Param, SeqPool, pack_sequences


class Batch:
    """Model inputs for a list of (user, movie) pairs, built from the Dataset's feature dicts."""

    def __init__(self, ds: Dataset, users: np.ndarray, movies: np.ndarray) -> None:
        self.users = np.asarray(users, dtype=np.int64)
        self.movies = np.asarray(movies, dtype=np.int64)
        u = self.users.tolist()
        side = np.zeros((len(u), N_GENDER + N_AGE + ds.n_jobs), dtype=np.float32)
        rows = np.arange(len(u))
        side[rows, [ds.user_gender.get(x, 0) for x in u]] = 1
        side[rows, [N_GENDER + ds.user_age.get(x, 0) for x in u]] = 1
        side[rows, [N_GENDER + N_AGE + ds.user_job.get(x, 0) for x in u]] = 1
        self.side = side
        m = self.movies.tolist()
        self.genres, self.genre_off = pack_sequences([ds.movie_genres.get(x, ()) for x in m])
        self.words, self.word_off = pack_sequences([ds.movie_words.get(x, ()) for x in m])

    def __len__(self) -> int:
        return len(self.users)

    def ids(self) -> Dict[str, np.ndarray]:
        """The distinct ids of each table this batch reads (the rows to pull, in Embedding's order)."""
        return {"user": Embedding.unique(self.users), "movie": Embedding.unique(self.movies),
                "genre": Embedding.unique(self.genres), "word": Embedding.unique(self.words)}


class Recommender(Layer):
    def __init__(self, emb: int, n_jobs: int, mean: float, seed: int = 0,
                 vocab: Optional[Mapping[str, int]] = None) -> None:
        """``vocab``: each table's id space (``Dataset.vocab_sizes``), needed to register the tables."""
        v = dict(vocab or {})
        self.emb = emb
        self.user_emb = Embedding("user", emb + 1, vocab=v.get("user"))
        self.movie_emb = Embedding("movie", emb + 1, vocab=v.get("movie"))
        self.genre_emb = Embedding("genre", emb, vocab=v.get("genre"))
        self.word_emb = Embedding("word", emb, vocab=v.get("word"))
        self.genre_pool = SeqPool("mean")
        self.word_pool = SeqPool("mean")
        self.user_cat = Concat()
        self.movie_cat = Concat()
        self.user_fc = Linear("user_fc", emb + N_GENDER + N_AGE + n_jobs, emb, seed=seed)
        self.movie_fc = Linear("movie_fc", 3 * emb, emb, seed=seed)
        self.mu = Param.create("mu", np.array([mean], dtype=np.float32))

    def tables(self) -> List[Embedding]:
        """The embedding layers, by table name."""
        return sorted((self.user_emb, self.movie_emb, self.genre_emb, self.word_emb), key=lambda e: e.table_name)

    def table_widths(self) -> Dict[str, int]:
        return {e.table_name: e.dim for e in self.tables()}

    def forward(self, b: Batch, rows: Dict[str, np.ndarray]) -> np.ndarray:
        """Predicted ratings (unclipped) for the batch; ``rows[t]`` are table t's rows for ``b.ids()[t]``."""
        d = self.emb
        ue = self.user_emb.forward(b.users, rows["user"])
        me = self.movie_emb.forward(b.movies, rows["movie"])
        g = self.genre_pool.forward(self.genre_emb.forward(b.genres, rows["genre"]), b.genre_off)
        w = self.word_pool.forward(self.word_emb.forward(b.words, rows["word"]), b.word_off)
        self._u = self.user_fc.forward(self.user_cat.forward([ue[:, :d], b.side]))
        self._v = self.movie_fc.forward(self.movie_cat.forward([me[:, :d], g, w]))
        return self.mu.value[0] + ue[:, d] + me[:, d] + (self._u * self._v).sum(axis=1)

    def backward(self, dpred: np.ndarray) -> None:
        """Accumulate dense grads into the Params and row-sparse grads into each Embedding."""
        d = self.emb
        self.mu.grad += dpred.sum()
        du = self.user_fc.backward(dpred[:, None] * self._v)
        dv = self.movie_fc.backward(dpred[:, None] * self._u)
        due = np.empty((len(dpred), d + 1), dtype=dpred.dtype)
        due[:, :d], _ = self.user_cat.backward(du)
        due[:, d] = dpred
        dme = np.empty_like(due)
        dme[:, :d], dg, dw = self.movie_cat.backward(dv)
        dme[:, d] = dpred
        self.user_emb.backward(due)
        self.movie_emb.backward(dme)
        self.genre_emb.backward(self.genre_pool.backward(dg))
        self.word_emb.backward(self.word_pool.backward(dw))


def predict(model: Recommender, ds: Dataset, pairs: np.ndarray, tables: Dict[str, Tuple[np.ndarray, np.ndarray]],
            batch_size: int = 8192) -> np.ndarray:
    """Clipped predictions for (user, movie) pairs from whole tables given as ``{name: (ids, rows)}``.

    Ids missing from a table (never trained, e.g. a movie only in the test split) get zero rows: the
    prediction then falls back on the remaining features and biases.
    """
    out = np.empty(len(pairs), dtype=np.float32)
    for lo in range(0, len(pairs), batch_size):
        b = Batch(ds, pairs[lo:lo + batch_size, 0], pairs[lo:lo + batch_size, 1])
        rows = {name: lookup(tables[name], ids) for name, ids in b.ids().items()}
        out[lo:lo + batch_size] = model.forward(b, rows)
    return np.clip(out, 1.0, 5.0)


def lookup(table: Tuple[np.ndarray, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Rows of sorted-``table_ids`` table for ``ids``; zeros for ids it lacks."""
    table_ids, table_rows = table
    pos = np.searchsorted(table_ids, ids)
    pos = np.minimum(pos, max(len(table_ids) - 1, 0))
    found = (table_ids[pos] == ids) if len(table_ids) else np.zeros(len(ids), dtype=bool)
    out = np.zeros((len(ids), table_rows.shape[1]), dtype=table_rows.dtype)
    out[found] = table_rows[pos[found]]
    return out


def rmse(pred: np.ndarray, target: Iterable[float]) -> float:
    t = np.asarray(list(target) if not isinstance(target, np.ndarray) else target, dtype=np.float64)
    return float(np.sqrt(np.mean((np.asarray(pred, dtype=np.float64) - t) ** 2)))


def all_ids(ds: Dataset, ratings: np.ndarray) -> Dict[str, np.ndarray]:
    """Every id of every table that ``ratings`` can touch (what to pull to save or evaluate a model)."""
    movies = np.unique(ratings[:, 1])
    genres: List[int] = [g for m in movies.tolist() for g in ds.movie_genres.get(m, ())]
    words: List[int] = [w for m in movies.tolist() for w in ds.movie_words.get(m, ())]
    return {"user": np.unique(ratings[:, 0]), "movie": movies, "genre": np.unique(np.asarray(genres, dtype=np.int64)),
            "word": np.unique(np.asarray(words, dtype=np.int64))}
