"""One tag grammar: ids of any kind round-trip through proxy credentials, reverse paths and headers,
as real clients send them."""

import base64
import urllib.parse

from hypothesis import given, strategies as st

from stepmill import tags as tagging

# Any Unicode the control API accepts as an id (no lone surrogates), the URL specials included.
ids = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40),
    st.text(st.sampled_from(list("/:@%?#  é\"~.-_a1")), min_size=1, max_size=12),
    st.sampled_from(["run/1", "..", ".", "~x", "%41", "a b", "run:1@x", "é", "t-1.2"]),
)


def basic(user: str, password: str | None) -> str:
    raw = f"{user}:{password}" if password is not None else user
    return "Basic " + base64.b64encode(raw.encode()).decode()


def as_client_sends(url: str) -> str:
    """Proxy-Authorization as Python clients build it from a proxy URL: user-info percent-decoded."""
    parts = urllib.parse.urlsplit(url)
    return basic(urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password)
                 if parts.password is not None else None)


def as_sent_verbatim(url: str) -> str:
    """...and as a client that does not decode user-info sends it."""
    userinfo = url.split("//", 1)[1].rsplit("@", 1)[0]
    return "Basic " + base64.b64encode(userinfo.encode()).decode()


@given(ids, ids)
def test_credentials_round_trip(trajectory, group):
    url = tagging.proxy_url("127.0.0.1", 8080, trajectory, group)
    parts = urllib.parse.urlsplit(url)
    assert (parts.hostname, parts.port) == ("127.0.0.1", 8080)  # the host is never part of an id
    for header in (as_client_sends(url), as_sent_verbatim(url)):
        tags = tagging.from_proxy_authorization(header)
        assert (tags.trajectory_id, tags.group_id) == (trajectory, group)


@given(ids, st.text(alphabet="abcXYZ019-_", min_size=1, max_size=40))
def test_credentials_with_a_secret(trajectory, secret):
    tags = tagging.from_proxy_authorization(as_client_sends(tagging.proxy_url("h", 1, trajectory, "g", secret)))
    assert (tags.trajectory_id, tags.secret) == (trajectory, secret)


@given(ids, ids, st.sampled_from(["/v1/chat/completions", "/v1/responses", "/"]))
def test_reverse_path_round_trip(trajectory, group, rest):
    base = "http://127.0.0.1:8080" + tagging.tag_path(trajectory, group)
    path = urllib.parse.urlsplit(base + rest).path  # as a client's URL library leaves it
    tags, left = tagging.split_tag_path(path)
    assert (tags.trajectory_id, tags.group_id, left) == (trajectory, group, rest)
    keyed, left = tagging.split_tag_path(tagging.tag_path(trajectory, secret="s3cr-t_") + rest)
    assert (keyed.trajectory_id, keyed.group_id, keyed.secret, left) == (trajectory, None, "s3cr-t_", rest)


@given(ids, ids, ids)
def test_headers_round_trip(trajectory, group, channel):
    headers = tagging.tag_headers(trajectory, group, channel)
    assert all(value.isascii() and value.isprintable() for value in headers.values())
    index = {name.lower(): value for name, value in headers.items()}
    tags = tagging.pop_header_tags({}, index)
    assert (tags.trajectory_id, tags.group_id, tags.channel) == (trajectory, group, channel)


def test_plain_ids_stay_readable_and_hand_written_ones_still_parse():
    assert tagging.proxy_url("h", 1, "arith20-3-0", "arith20-3") == "http://arith20-3-0:arith20-3@h:1"
    tags, rest = tagging.split_tag_path("/t/run%201/g/grp/v1/chat/completions")
    assert (tags.trajectory_id, tags.group_id, rest) == ("run 1", "grp", "/v1/chat/completions")
    assert tagging.split_tag_path("/t/~%%%/v1/x") is None  # not an id: the path is left alone
