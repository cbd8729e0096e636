"""``make submit ... IMAGE=x.sqsh DRY_RUN=1`` prints the job whether or not the image file exists
yet, saying when it is missing (``slurm.submit``); a real submission still needs the file. A site
file's ``image`` is taken as ``IMAGE=`` is."""

import pytest

from slurm.submit import main

JOB = ["--preset", "h100-dgx", "--model", "tiny", "--nodes", "1"]


@pytest.fixture(autouse=True)
def no_site_file(monkeypatch):
    monkeypatch.delenv("MOE_TRAIN_SITE", raising=False)


def submit(capsys, *extra: str) -> tuple[int, str, str]:
    code = main([*JOB, *extra])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_a_dry_run_with_a_missing_image_prints_the_job(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    code, out, _ = submit(capsys, "--image", str(image), "--dry-run")
    assert code == 0 and f"--container-image={image}" in out, out


def test_a_dry_run_with_a_missing_image_says_it_is_missing(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    _, _, err = submit(capsys, "--image", str(image), "--dry-run")
    assert "does not exist yet" in err and str(image) in err, err


def test_a_dry_run_with_an_existing_image_says_nothing_of_it(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    image.write_bytes(b"")
    _, _, err = submit(capsys, "--image", str(image), "--dry-run")
    assert "does not exist" not in err, err


def test_a_relative_missing_image_is_named_by_its_absolute_path(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, out, _ = submit(capsys, "--image", "kit.sqsh", "--dry-run")
    assert f"--container-image={tmp_path / 'kit.sqsh'}" in out, out


def test_submitting_with_a_missing_image_is_still_an_error(capsys, tmp_path):
    code, _, err = submit(capsys, "--image", str(tmp_path / "kit.sqsh"))
    assert code == 2 and "does not exist" in err, err


def site_with_image(tmp_path, image) -> str:
    site = tmp_path / "site.toml"
    site.write_text(f'image = "{image}"\n')
    return str(site)


def test_a_dry_run_with_a_site_file_s_missing_image_prints_the_job(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    code, out, _ = submit(capsys, "--site", site_with_image(tmp_path, image), "--dry-run")
    assert code == 0 and f"--container-image={image}" in out, out


def test_a_dry_run_with_a_site_file_s_missing_image_says_it_is_missing(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    _, _, err = submit(capsys, "--site", site_with_image(tmp_path, image), "--dry-run")
    assert "does not exist yet" in err and str(image) in err, err


def test_a_host_preset_s_dry_run_ignores_a_site_file_s_missing_image(capsys, tmp_path):
    site = site_with_image(tmp_path, tmp_path / "kit.sqsh")
    code = main(["--preset", "cpu-local", "--model", "tiny", "--nodes", "1", "--site", site, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 0 and "kit.sqsh" not in err, err


def test_submitting_with_a_site_file_s_missing_image_is_still_an_error(capsys, tmp_path):
    code, _, err = submit(capsys, "--site", site_with_image(tmp_path, tmp_path / "kit.sqsh"))
    assert code == 2 and "does not exist" in err, err
