"""The shapes world: scenes, rendering at any size, questions, captions and the analytic judge."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from PIL import Image, ImageFilter

from ernie5.data.shapes import (
    COLOR_NAMES,
    COLORS,
    COUNT_CHOICES,
    JUDGE_VERSION,
    KINDS,
    POSITION_WORDS,
    QA,
    YES_NO,
    Scene,
    Shape,
    attribute_questions,
    caption,
    classify_shape,
    judge,
    parse_image,
    prompt_for,
    random_scene,
    relational_questions,
    render,
)

PERFECT = {"shape_acc": 1.0, "colour_acc": 1.0, "position_acc": 1.0, "all_correct": 1.0}


def _scene(*shapes: tuple[str, str, int, int]) -> Scene:
    return Scene(tuple(Shape(kind, color, (row, col)) for kind, color, row, col in shapes))


def _noisy(img: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0.0, sigma, img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def test_random_scene_rules_and_determinism():
    sizes = set()
    for seed in range(300):
        scene = random_scene(random.Random(seed))
        assert scene == random_scene(random.Random(seed))
        cells = [s.cell for s in scene.shapes]
        assert 1 <= len(scene.shapes) <= 3 and cells == sorted(set(cells))
        assert len({s.color for s in scene.shapes}) == len(scene.shapes)
        sizes.add(len(scene.shapes))
    assert sizes == {1, 2, 3}
    assert len(random_scene(random.Random(0), n_shapes=6).shapes) == 6


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Shape("star", "red", (0, 0)), "kind='star'"),
        (lambda: Shape("circle", "orange", (0, 0)), "color='orange'"),
        (lambda: Shape("circle", "red", (3, 0)), r"cell=\(3, 0\)"),
        (lambda: _scene(("circle", "red", 1, 1), ("square", "blue", 1, 1)), "distinct cells"),
        (lambda: random_scene(random.Random(0), n_shapes=7), "n_shapes=7"),
    ],
)
def test_invalid_scenes(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_render_format_and_determinism():
    scene = _scene(("circle", "red", 0, 0), ("triangle", "cyan", 2, 2))
    img = render(scene)
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    assert np.array_equal(img, render(scene)) and img[16, 16].tolist() == [0, 0, 0]
    assert img[5, 5].tolist() == list(COLORS["red"])  # centre of the top-left cell
    assert render(scene, 64).shape == (64, 64, 3)


def test_sizes_share_one_layout():
    for seed in range(50):
        scene = random_scene(random.Random(seed))
        small = render(scene, 32).astype(np.float64)
        down = np.asarray(Image.fromarray(render(scene, 64)).resize((32, 32), Image.BOX)).astype(np.float64)
        assert np.abs(small - down).mean() < 2.0
        assert parse_image(render(scene, 64)) == parse_image(render(scene, 32)) == scene


@pytest.mark.parametrize("size", [16, 32, 64])
def test_judge_is_exact_on_clean_renders(size):
    for seed in range(200):
        scene = random_scene(random.Random(seed))
        assert judge(render(scene, size), scene) == PERFECT, (seed, scene)


@pytest.mark.parametrize(
    ("transform", "min_all_correct"),
    [
        (lambda img: _noisy(img, 20, 0), 0.99),
        (lambda img: _noisy(img, 30, 0), 0.85),
        (lambda img: np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(1.0))), 0.99),
        (lambda img: (img * 0.7).astype(np.uint8), 0.99),
        (lambda img: np.roll(img, 1, axis=(0, 1)), 0.99),
    ],
)
def test_judge_is_robust_to_mild_corruption(transform, min_all_correct):
    scores = []
    for seed in range(100):
        scene = random_scene(random.Random(seed))
        result = judge(transform(render(scene)), scene)
        assert result["colour_acc"] == result["position_acc"] == 1.0
        scores.append(result["all_correct"])
    assert np.mean(scores) >= min_all_correct


def test_judge_degrades_with_noise():
    def mean_all_correct(sigma: float) -> float:
        scenes = [random_scene(random.Random(seed)) for seed in range(100)]
        return float(
            np.mean([judge(_noisy(render(s), sigma, i), s)["all_correct"] for i, s in enumerate(scenes)])
        )

    clean, mild, heavy = mean_all_correct(0), mean_all_correct(30), mean_all_correct(60)
    assert clean == 1.0 >= mild > heavy


@pytest.mark.parametrize(
    ("drawn", "target", "expected"),
    [
        (
            _scene(("circle", "red", 0, 0), ("square", "blue", 2, 1)),
            _scene(("triangle", "red", 0, 0), ("square", "blue", 2, 1)),
            {"shape_acc": 0.5, "colour_acc": 1.0, "position_acc": 1.0, "all_correct": 0.0},
        ),
        (
            _scene(("circle", "green", 0, 0)),
            _scene(("circle", "red", 0, 0)),
            {"shape_acc": 1.0, "colour_acc": 0.0, "position_acc": 1.0, "all_correct": 0.0},
        ),
        (
            _scene(("circle", "red", 0, 0), ("square", "blue", 1, 1)),
            _scene(("circle", "red", 0, 0)),
            {"shape_acc": 1.0, "colour_acc": 1.0, "position_acc": 0.5, "all_correct": 0.0},
        ),
        (
            _scene(("circle", "red", 0, 1)),
            _scene(("circle", "red", 0, 0), ("square", "blue", 2, 2)),
            {"shape_acc": 0.0, "colour_acc": 0.0, "position_acc": 0.0, "all_correct": 0.0},
        ),
        (_scene(), _scene(), PERFECT),
    ],
)
def test_judge_scores_mismatches(drawn, target, expected):
    assert judge(render(drawn), target) == expected


def test_parse_blank_and_validates_input():
    assert parse_image(np.zeros((32, 32, 3), np.uint8)) == Scene(())
    assert parse_image(np.full((32, 32, 3), 128, np.uint8)) == Scene(())  # grey is no palette colour
    with pytest.raises(ValueError, match="square"):
        parse_image(np.zeros((32, 16, 3), np.uint8))
    with pytest.raises(ValueError, match="size=64"):
        parse_image(np.zeros((32, 32, 3), np.uint8), 64)
    assert JUDGE_VERSION == 1


@pytest.mark.parametrize(
    ("fill", "skew", "kind"),
    [(1.0, 0.0, "square"), (0.785, 0.0, "circle"), (0.5, -0.57, "triangle"), (0.8, -0.3, "triangle")],
)
def test_classify_shape(fill, skew, kind):
    assert classify_shape(fill, skew) == kind


@pytest.mark.parametrize(
    ("scene", "text"),
    [
        (_scene(("circle", "red", 0, 0)), "a red circle at the top left"),
        (
            _scene(("circle", "red", 0, 0), ("square", "blue", 2, 1)),
            "a red circle at the top left and a blue square at the bottom",
        ),
        (
            _scene(("triangle", "yellow", 0, 1), ("circle", "cyan", 1, 1), ("square", "magenta", 1, 2)),
            "a yellow triangle at the top, a cyan circle at the centre and a magenta square at the right",
        ),
        (_scene(), "an empty scene"),
    ],
)
def test_captions(scene, text):
    assert caption(scene) == prompt_for(scene) == text


TWO = _scene(("circle", "red", 0, 0), ("square", "blue", 2, 1))
THREE = _scene(("square", "green", 0, 2), ("square", "yellow", 1, 0), ("triangle", "blue", 2, 2))


@pytest.mark.parametrize(
    ("scene", "question", "answer"),
    [
        (TWO, "What colour is the circle?", "red"),
        (TWO, "What shape is the blue object?", "square"),
        (TWO, "Where is the blue square?", "bottom"),
        (TWO, "What colour is the object at the top left?", "red"),
        (THREE, "What colour is the triangle?", "blue"),
        (THREE, "Where is the yellow square?", "left"),
        (THREE, "What shape is the green object?", "square"),
    ],
)
def test_attribute_answers(scene, question, answer):
    qas = {qa.question: qa for qa in attribute_questions(scene, random.Random(0))}
    assert qas[question].answer == answer


def test_ambiguous_attribute_questions_are_not_asked():
    questions = {qa.question for qa in attribute_questions(THREE, random.Random(0))}
    assert "What colour is the square?" not in questions  # two squares
    assert "What colour is the triangle?" in questions


@pytest.mark.parametrize(
    ("scene", "question", "answer"),
    [
        (TWO, "What shape is right of the red object?", "square"),
        (TWO, "What shape is below the red object?", "square"),
        (TWO, "Is the red circle above the blue square?", "yes"),
        (TWO, "Is the red circle right of the blue square?", "no"),
        (TWO, "How many objects are there?", "2"),
        (TWO, "How many triangles are there?", "0"),
        (TWO, "What colour is the object nearest the blue square?", "red"),
        (THREE, "What shape is left of the green object?", "square"),  # blue is in the same column
        (THREE, "What shape is above the blue object?", None),  # green and yellow: not asked
        (THREE, "What shape is left of the blue object?", "square"),
        (THREE, "What shape is below the green object?", None),
        (THREE, "What shape is right of the yellow object?", None),
        (THREE, "Is the blue triangle below the green square?", "yes"),
        (THREE, "Is the yellow square left of the blue triangle?", "yes"),
        (THREE, "How many squares are there?", "2"),
        (THREE, "How many objects are there?", "3"),
        (THREE, "What colour is the object nearest the green square?", "blue"),
        (THREE, "What colour is the object nearest the yellow square?", None),  # tie at distance 3
    ],
)
def test_relational_answers(scene, question, answer):
    qas = {qa.question: qa.answer for qa in relational_questions(scene, random.Random(0))}
    assert qas.get(question) == answer


def test_every_answer_is_among_its_vocabulary():
    vocabularies = {COLOR_NAMES, KINDS, POSITION_WORDS, YES_NO, COUNT_CHOICES}
    for seed in range(200):
        rng = random.Random(seed)
        scene = random_scene(rng)
        qas = attribute_questions(scene, rng) + relational_questions(scene, rng)
        assert qas and all(isinstance(qa, QA) for qa in qas)
        assert all(qa.answer in qa.choices and qa.choices in vocabularies for qa in qas)
        assert len({qa.question for qa in qas}) == len(qas)


def test_questions_are_shuffled_by_the_rng():
    first = [qa.question for qa in relational_questions(THREE, random.Random(0))]
    assert first == [qa.question for qa in relational_questions(THREE, random.Random(0))]
    assert first != [qa.question for qa in relational_questions(THREE, random.Random(1))]


def test_render_1000_scenes_is_fast():
    rng = random.Random(0)
    scenes = [random_scene(rng) for _ in range(1000)]
    start = time.perf_counter()
    for scene in scenes:
        render(scene, 32)
    assert time.perf_counter() - start < 2.0
