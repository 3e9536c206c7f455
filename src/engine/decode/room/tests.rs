//! Unit tests of a decode room's decisions.

use super::Taken;

#[test]
fn whole_pages_are_taken_once() {
    let mut t = Taken::default();
    t.whole(0, 0, 3).unwrap();
    t.whole(1, 0, 3).unwrap(); // another buffer
    t.whole(0, 70, 2).unwrap(); // past the first word
    assert_eq!(t.whole(0, 2, 2).unwrap_err(), "position 2");
    assert_eq!(t.whole(0, 71, 1).unwrap_err(), "position 71");
    t.whole(0, 3, 1).unwrap();
}

#[test]
fn parts_of_a_page_are_disjoint_and_merge_when_adjacent() {
    let mut t = Taken::default();
    t.part(0, 5, 100, 50).unwrap();
    t.part(0, 5, 0, 50).unwrap();
    t.part(0, 5, 50, 50).unwrap(); // joins both neighbours
    assert_eq!(t.parts[&(0, 5)], vec![(0, 150)]);
    assert!(t.part(0, 5, 149, 2).is_err());
    assert!(t.part(0, 5, 0, 1).is_err());
    t.part(0, 5, 200, 10).unwrap();
    t.part(0, 5, 150, 10).unwrap(); // joins the first only
    assert_eq!(t.parts[&(0, 5)], vec![(0, 160), (200, 210)]);
    assert!(t.part(0, 5, 190, 20).is_err());
    t.part(0, 5, 190, 10).unwrap();
    assert_eq!(t.parts[&(0, 5)], vec![(0, 160), (190, 210)]);
    t.part(0, 6, 0, 10).unwrap(); // another position
}

#[test]
fn a_whole_page_and_a_part_of_it_exclude_each_other() {
    let mut t = Taken::default();
    t.whole(0, 1, 1).unwrap();
    assert!(t.part(0, 1, 0, 8).is_err());
    t.part(0, 2, 0, 8).unwrap();
    assert!(t.whole(0, 2, 1).is_err());
    assert!(t.whole(0, 0, 3).is_err());
}
